-- Undo 0005. The old key holds one dead letter per source offset whatever the broker
-- cluster: of dead letters that differ only by cluster, the first is kept.
ALTER TABLE dead_letters DROP CONSTRAINT IF EXISTS dead_letters_source;
DELETE FROM dead_letters d USING dead_letters e
 WHERE d.consumer = e.consumer AND d.source_topic = e.source_topic
   AND d.source_partition = e.source_partition AND d.source_offset = e.source_offset
   AND d.id > e.id;
ALTER TABLE dead_letters DROP COLUMN IF EXISTS cluster_id;
ALTER TABLE dead_letters ADD UNIQUE (consumer, source_topic, source_partition, source_offset);

-- 0005 dead letters by broker cluster: a dead letter is kept once per source record,
-- and a source record is (cluster, topic, partition, offset). The embedded broker starts
-- empty under a new cluster id and reuses the old log's offsets; keyed without the
-- cluster, a new log's dead letter at such an offset was silently not kept.
DO $$
DECLARE old_key text;
BEGIN
    SELECT conname INTO old_key FROM pg_constraint
     WHERE conrelid = 'dead_letters'::regclass AND contype = 'u'
       AND pg_get_constraintdef(oid)
           = 'UNIQUE (consumer, source_topic, source_partition, source_offset)';
    IF old_key IS NOT NULL THEN
        EXECUTE format('ALTER TABLE dead_letters DROP CONSTRAINT %I', old_key);
    END IF;
END $$;
ALTER TABLE dead_letters ADD COLUMN cluster_id text NOT NULL DEFAULT '';
ALTER TABLE dead_letters ADD CONSTRAINT dead_letters_source
    UNIQUE (consumer, cluster_id, source_topic, source_partition, source_offset);

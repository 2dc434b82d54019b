-- Undo 0011: new rows compressed with the server's default again.
ALTER TABLE checkpoints ALTER COLUMN state SET COMPRESSION default;
ALTER TABLE graph_blobs ALTER COLUMN blob SET COMPRESSION default;

-- Undo 0023.
DROP FUNCTION IF EXISTS alma_stale(text);

-- Undo 0017.
DROP TABLE IF EXISTS tenant_settings;

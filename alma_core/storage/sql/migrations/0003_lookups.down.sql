-- Undo 0003.
DROP INDEX IF EXISTS dead_letters_run;
DROP INDEX IF EXISTS dead_letters_event;

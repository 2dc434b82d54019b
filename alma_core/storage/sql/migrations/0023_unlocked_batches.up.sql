-- 0023 a checkpointer batch read without locks (issue 54): the batch's runs and its
-- partitions' offsets are read as committed, folded, and written in one statement that
-- commits alone (no BEGIN, no COMMIT: two round trips fewer). The statement checks that
-- every run it writes is the row version it read (or still absent) and every partition's
-- stored offset the one it read; where one is not, it calls this function, which fails
-- the statement (nothing of it is written) with serialization_failure, and the batch is
-- applied again in a transaction under the runs' locks.
-- Additive: workers built for 0020 to 0022 never call it.
-- oldest-worker: 20
CREATE FUNCTION alma_stale(what text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'alma: % changed since the batch read it', what
        USING ERRCODE = 'serialization_failure';
END
$$;

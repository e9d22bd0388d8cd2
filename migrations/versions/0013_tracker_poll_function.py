"""The tracker's poll as a PostgreSQL function whose plan cannot read the whole fleet (issue 42).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29

A receiver's poll reads the next hosts' holdings after its cursor (``ORDER BY host LIMIT 32``
on the primary key). During a rollout the holdings of the file's generation are new rows the
table's statistics have never seen, so the planner takes the file's rows to be a handful and
reads all of them through a bitmap scan, joins each to its host and sorts them, rather than
walking the key and stopping after 32. Measured with ``tierd bench tracker`` on the H200 host's
PostgreSQL 15 (pg_stat_statements, auto_explain): at 1,000 hosts a poll touched 842 buffers and
took 17 ms of the server (30% of the busy backends waited on ``LWLock: BufferContent``); with
bitmap scans off the same poll touched 108 and took 0.54 ms, whatever the fleet's size.
Statistics do not rescue it: autovacuum analyzes a table at most once a minute, and a 16 GiB
rollout at 2 GB/s is over in ten seconds.

So on PostgreSQL the poll is this function, which turns bitmap scans off for itself alone (a
function's ``SET`` clause; the catalog's other queries keep them) and, in the same round trip,
reads on from the fleet's start when the window passes its end (a second statement before).
It is PL/pgSQL, not SQL, because PL/pgSQL keeps its statement's plan for the session: a SQL
function is planned at every call, 2 ms of a poll's 2.7 on the 2-core machine.
SQLite runs the same statements from :mod:`tiering.catalog.tracker` and needs none of this.
A change to the poll's SQL is a new migration that replaces the function.
"""

from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_ARGS = "integer, integer, varchar, boolean, bytea, integer, double precision, varchar, integer"

_FUNCTION = """
CREATE OR REPLACE FUNCTION tierd_poll(
    p_file_id integer, p_generation integer, p_me varchar, p_write boolean, p_have bytea,
    p_pieces integer, p_now double precision, p_after varchar, p_limit integer)
RETURNS TABLE (
    told bigint, file_id integer, host varchar, generation integer, have bytea,
    pieces integer, updated_at double precision, origin_until double precision,
    address varchar, last_heartbeat double precision, part integer)
LANGUAGE plpgsql VOLATILE
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
BEGIN
RETURN QUERY
WITH told AS (
    INSERT INTO piece_holdings AS ph
        (file_id, host, generation, have, pieces, origin_until, updated_at)
    SELECT p_file_id, p_me, p_generation, p_have, p_pieces, NULL, p_now
    FROM piece_maps JOIN files ON files.id = piece_maps.file_id
    WHERE p_write AND piece_maps.file_id = p_file_id AND piece_maps.generation = p_generation
      AND files.generation = p_generation
    ON CONFLICT (file_id, host) DO UPDATE SET
        have = excluded.have, pieces = excluded.pieces, updated_at = excluded.updated_at,
        origin_until = CASE WHEN ph.generation = excluded.generation THEN ph.origin_until END,
        generation = excluded.generation
    RETURNING ph.host
),
ahead AS (
    SELECT h.* FROM piece_holdings h
    WHERE h.file_id = p_file_id AND h.generation = p_generation AND h.host <> p_me
      AND h.host > p_after
    ORDER BY h.host LIMIT p_limit
),
wrapped AS (
    SELECT h.* FROM piece_holdings h
    WHERE h.file_id = p_file_id AND h.generation = p_generation AND h.host <> p_me
      AND h.host <= p_after
    ORDER BY h.host LIMIT greatest(0, p_limit - (SELECT count(*) FROM ahead))
),
claims AS (
    SELECT h.* FROM piece_holdings h
    WHERE h.file_id = p_file_id AND h.generation = p_generation AND h.host <> p_me
      AND h.origin_until IS NOT NULL AND h.origin_until > p_now
),
seen AS (
    SELECT a.*, 0 AS part FROM ahead a
    UNION ALL SELECT w.*, 2 FROM wrapped w
    UNION ALL SELECT c.*, 1 FROM claims c
)
SELECT (SELECT count(*) FROM told), s.file_id, s.host::varchar, s.generation, s.have, s.pieces,
       s.updated_at, s.origin_until, o.address::varchar, o.last_heartbeat, s.part
FROM (SELECT 1) AS one
LEFT JOIN seen s ON true
LEFT JOIN hosts o ON o.host_id = s.host
ORDER BY s.part, s.host;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS tierd_poll({_ARGS})")

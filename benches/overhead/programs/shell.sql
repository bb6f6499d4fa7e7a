-- The sqlite3 shell's workload (programs.rs): {rows} rows made by a
-- recursive CTE, two indexes, a few queries, an update and a delete. No
-- randomness, so that every run makes the same allocator calls.
CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, payload TEXT, n INTEGER);
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {rows})
INSERT INTO t(name, payload, n)
  SELECT printf('name-%08d', (x * 7919) % 200003),
         printf('%.*c', 20 + (x * 31) % 300, 'x'),
         (x * 2654435761) % 1000003
  FROM c;
CREATE INDEX t_name ON t(name);
CREATE INDEX t_n ON t(n);
SELECT count(*), sum(length(payload)) FROM t;
SELECT n % 100 AS k, count(*) FROM t GROUP BY k ORDER BY 2 DESC, 1 LIMIT 5;
UPDATE t SET payload = upper(payload) WHERE id % 10 = 0;
DELETE FROM t WHERE id % 7 = 0;
SELECT count(*), max(name) FROM t;

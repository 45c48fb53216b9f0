"""The SQL engines (SQLite, PostgreSQL, MySQL/MariaDB): schema.py (tables and the `Dialect`
each engine supplies), connection.py (one connection, one transaction per operation), and the
capabilities over them, written once for every dialect: ranges.py (segment keys, one statement
per range), cas.py, leases.py, quorum.py. sqlite.py, postgres.py and mysql.py are the dialects:
how each connects, what it calls now, how it reports replication."""

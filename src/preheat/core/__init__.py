"""The foundation every layer stands on, importing nothing else of preheat: the error tree (``errors``), settings and
sizes (``config``), JSON from outside (``jsonsafe``), the cold-start timeline record (``timeline``), durable writes
(``durable``), progress (``progress``) and child processes (``procs``)."""

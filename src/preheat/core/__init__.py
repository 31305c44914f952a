"""The foundation every layer stands on, importing nothing else of preheat: the error tree (``errors``), every
environment variable and its one reader (``env``), settings declared once (``config``), sizes (``sizes``), JSON from
outside (``jsonsafe``), the cold-start timeline record (``timeline``), durable writes (``durable``), the retry policy
(``backoff``), progress (``progress``) and child processes (``procs``)."""

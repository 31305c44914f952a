"""preheat's one HTTP layer: the one client (``client``: timeouts, redirects, credentials, the one mapping of network
failures onto ``HTTPClientError``; ``pool``: kept-alive connections by origin), the server base every preheat server
stands on (``preheat serve``, the router, the peer server, the file server) and the Prometheus exposition they share.

Standard library only on the serving path: ``preheat serve`` binds before it imports anything heavy.
"""

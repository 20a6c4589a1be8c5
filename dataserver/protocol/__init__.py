"""What every ffplane process shares with the data server, and nothing else: the error hierarchy
and its statuses (``errors``), the job token (``auth``), the heartbeat datagrams
(``heartbeat``), reading mapped files (``pagemap``), the list of data servers a client is given
(``servers``) and the etcd client (``etcd``). It imports nothing of ffplane but itself, so the
daemon and the client library can depend on it without depending on the server.
"""

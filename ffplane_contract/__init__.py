"""What every ffplane process agrees on, and nothing else: the error hierarchy and its statuses
(``errors``), the job token (``auth``), the limits on values from outside (``limits``), the
heartbeat datagrams (``heartbeat``), the list of data servers a client is given (``servers``), the
rule for a restorable step (``restorable``), the settings layer every command reads (``settings``,
declared in the terms of ``setting_types``), the control-socket messages between a worker and its
daemon (``control``), the shard header (``shard``) and checksum (``checksum``), the durable tier's
file format (``durable``), the names of shared files (``files``) and the warm-start zygotes' folder
(``warm``).

It imports nothing else of ffplane (``tests/test_layout.py``), so the data server, the node daemon
and the client library each depend on it and on none of the others.
"""

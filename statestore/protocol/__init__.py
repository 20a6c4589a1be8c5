"""What a worker shares with its node daemon: the control-socket messages (``control``), the
shard header (``shard``), the names of shared files (``files``), the durable tier's file format
(``durable``), the shard checksum (``checksum``) and the warm-start zygotes' folder (``warm``).
Training code imports this, never the daemon's modules.
"""

"""How the driver reaches its workers: in-process, `mp` (spawned processes) and `ray`
(actors), the last two over the ZeroMQ step channel."""

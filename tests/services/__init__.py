"""Service tests: real scheduler, worker and front processes over gRPC/HTTP on loopback."""

"""The fleet path: export to serving engines, ingest their metrics, Prometheus exposition."""

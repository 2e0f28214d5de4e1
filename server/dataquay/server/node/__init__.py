"""The daemon that runs on every compute node: cache, reads, staging, exchange."""

"""Cluster tooling: pre-flight checks, the doctor and the ISC rehearsal (see cluster/README.md)."""

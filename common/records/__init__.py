"""What a run records: provenance, telemetry, heartbeats, profiles, logs and its summary."""

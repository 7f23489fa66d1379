"""Strong Compute ISC experiment files and the local rapid-cycling rehearsal."""

"""A run's workdir: each artefact's writer and reader together, and the names of them all."""

"""Ray Data job definitions (the dataflow wiring); the stages they run are :mod:`helix_ray.ingest`'s."""

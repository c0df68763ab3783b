"""Where every parameter lives across tensor- and pipeline-parallel ranks (pure rules)."""

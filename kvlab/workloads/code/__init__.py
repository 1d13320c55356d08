"""Code edits: source files, edit scripts, prefix reuse after an edit and its cost accounting."""

"""RAG prompts assembled from cached document chunks, and what each reuse strategy costs."""

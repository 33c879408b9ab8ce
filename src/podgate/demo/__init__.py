"""Sample pods for `podgate up` and the in-memory demo API for `podgate demo` and the tests."""

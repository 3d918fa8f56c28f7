"""One file per schema revision; 0001 creates the first schema."""

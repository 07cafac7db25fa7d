"""Vision towers and the connectors that turn their patch features into a text model's input
embeddings: the part of a vision-language model an image encoder runs."""

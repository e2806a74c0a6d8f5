"""In-tree backends, installed as the import package ``deepinfer_backends``."""

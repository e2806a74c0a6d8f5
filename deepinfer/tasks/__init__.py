"""What ``python -m deepinfer task=...`` runs: each task takes the composed
:class:`~deepinfer.config.schema.AppConfig`."""

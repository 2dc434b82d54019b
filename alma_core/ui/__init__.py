"""The run inspector (``alma ui``): a read-only web app over one tenant's runs."""

from alma_core.ui.app import create_app

__all__ = ["create_app"]

"""The ``exl2fmt`` command line (typer).  Entry point: ``exl2fmt.cli.app:main``."""

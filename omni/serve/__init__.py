"""`omni serve`: an OpenAI-compatible HTTP server (FastAPI on AsyncOmni; see app.py).

Nothing is imported here: `omni --help` imports this package's CLI options (launch.py) without
loading FastAPI or Ray.
"""

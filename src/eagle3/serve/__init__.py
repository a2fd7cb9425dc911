"""`eagle3 serve`: an OpenAI-compatible HTTP server over the batching engine (`eagle3.engine`).

`build_app(engine, model_name)` returns the FastAPI app; the command line starts the
engine and runs it under uvicorn. Needs `pip install 'eagle3[serve]'`.
"""

from .app import build_app

__all__ = ["build_app"]

"""The HTTP settings of `atomrt serve`, in a module of their own: the command reads them, and
starts the engine core, before the API process imports the HTTP stack (FastAPI, uvicorn)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None
    api_key: Optional[str] = None
    max_queued_requests: int = 1024
    max_request_bytes: int = 1 << 20
    shutdown_timeout: float = 30.0
    start_timeout: float = 3600.0  # load + compile + capture of the engine core
    # tool_choice "auto": the model's own tool calls, read from its text by this parser
    # (runtime/entrypoints/openai/tool_parsers.py; vLLM's --enable-auto-tool-choice and
    # --tool-call-parser)
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None

"""Live fleet state helpers: prompt token counting, ``/metrics`` scraping,
the asyncio front of the Rust admission queue."""

from pdgate.state.admission import AsyncAdmission
from pdgate.state.scraper import MetricsScraper, parse_vllm_metrics
from pdgate.state.tokens import TokenCounter

__all__ = ["AsyncAdmission", "MetricsScraper", "TokenCounter", "parse_vllm_metrics"]

"""The built-in ``search`` tool: BM25 retrieval over a local corpus file, for Search-R1-style data.

Config (``{name: search, config: {corpus_path: ..., top_k: 3}}``; a relative ``corpus_path`` is relative to the
tool config's folder). The corpus is JSONL, one document per line, as Search-R1's wiki corpus: ``"contents"``
(Search-R1: the first line is the title, the rest the text) or ``"text"``, and an optional ``"title"`` (then
``contents`` / ``text`` is all text). The index (the ``bm25s`` library, English stop words, no stemming) is
built once, when the tool is made, so a missing or malformed corpus stops the run before any model loads.

A call ``search(query)`` returns the ``top_k`` best documents formatted as Search-R1 does
(``Doc 1(Title: <title>) <text>``, one per line); documents that share no word with the query are left out, and
when none is left the text is :data:`NO_MATCH`. ``bm25s`` is an optional dependency (``pip install
'portrl[agent]'``), imported when a search tool is made.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

from portrl.agent.tools.base import Tool, ToolResult
from portrl.errors import UserError

NO_MATCH = "No document matches the query."


def _bm25s():
    try:
        import bm25s  # noqa: PLC0415  (optional dependency: bm25s)
    except ImportError:
        raise UserError("the search tool needs the bm25s package, which is not installed; install it with "
                        "pip install 'portrl[agent]'") from None
    return bm25s


def read_corpus(path: "str | os.PathLike[str]") -> List[Tuple[str, str]]:
    """(title, text) of every document of the JSONL corpus at ``path`` (module docstring); UserError naming the
    file and line for a missing file, a line that is not a JSON object or a document without text."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"search corpus {str(path)!r} does not exist (config.corpus_path of the search tool); "
                        "give a JSONL file, one {\"contents\": ...} or {\"title\": ..., \"text\": ...} per line")
    docs = []
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"search corpus {str(path)!r} line {lineno}: not JSON ({exc.msg}); one JSON object "
                                "per line") from None
            body = doc.get("contents", doc.get("text")) if isinstance(doc, dict) else None
            if not isinstance(body, str):
                raise UserError(f"search corpus {str(path)!r} line {lineno}: no \"contents\" or \"text\" string; "
                                "valid: {\"contents\": \"Title\\ntext\"} or {\"title\": ..., \"text\": ...}")
            if isinstance(doc.get("title"), str):
                docs.append((doc["title"], body))
            elif "contents" in doc:
                title, _, text = body.partition("\n")
                docs.append((title, text))
            else:
                docs.append(("", body))
    if not docs:
        raise UserError(f"search corpus {str(path)!r} holds no document; one JSON object per line")
    return docs


class SearchTool(Tool):
    """``search(query)``: the best ``top_k`` documents of the corpus (module docstring)."""

    name = "search"
    config_paths = ("corpus_path",)  # resolved against the tool config's folder (portrl.agent.tools.config)
    schema = {"type": "function", "function": {
        "name": "search",
        "description": "Search the knowledge base; returns the most relevant documents.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to search for"}},
            "required": ["query"]}}}

    def __init__(self, corpus_path: str, top_k: int = 3) -> None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
        bm25s = _bm25s()
        self.top_k = top_k
        self.docs = read_corpus(corpus_path)
        self._tokenize = bm25s.tokenize
        tokens = bm25s.tokenize([f"{title}\n{text}" for title, text in self.docs], stopwords="en",
                                show_progress=False)
        self.index = bm25s.BM25()
        self.index.index(tokens, show_progress=False)

    def search(self, query: str) -> List[Tuple[str, str]]:
        """(title, text) of the best documents for ``query``, best first, those sharing no word left out."""
        tokens = self._tokenize([query], stopwords="en", show_progress=False, return_ids=False)
        if not tokens[0]:
            return []
        ids, scores = self.index.retrieve(tokens, k=min(self.top_k, len(self.docs)), show_progress=False)
        return [self.docs[int(i)] for i, s in zip(ids[0], scores[0]) if s > 0]

    def call(self, arguments: Dict[str, Any], row_kwargs: Dict[str, Any]) -> ToolResult:
        hits = self.search(str(arguments["query"]))
        if not hits:
            return ToolResult(text=NO_MATCH)
        return ToolResult(text="".join(f"Doc {i}(Title: {title}) {text}\n" for i, (title, text) in
                                       enumerate(hits, 1)))

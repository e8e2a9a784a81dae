"""Sentence splitting for BERT-style data with nltk's Punkt, as Megatron-LM's preprocess_data.py
splits: the pretrained Punkt model of the language when its data is installed
(``python -m nltk.downloader punkt_tab``), else an untrained Punkt splitter (said once).

With ``keep_newlines`` the sentence-end pattern also takes the whitespace after a sentence, so
newlines between sentences stay in the text instead of being eaten.
"""

from __future__ import annotations

from typing import Optional

# Megatron-LM splits documents in pieces of this many characters before Punkt sees them.
MAX_SPLIT_CHARS = 1_000_000


def _newline_keeping_vars():
    from nltk.tokenize.punkt import PunktLanguageVars

    class KeepNewlines(PunktLanguageVars):
        # Punkt's default requires whitespace *between* the sentence end and the next token, and
        # drops it from both sentences. Here the whitespace joins the sentence that ends, and
        # the next token needs none before it.
        _period_context_fmt = r"""
            \S*                          # word characters before the ending
            %(SentEndChars)s             # a candidate sentence end
            \s*                          # whitespace, newlines included, stays with this sentence
            (?=(?P<after_tok>
                %(NonWord)s              # followed by more punctuation
                |
                (?P<next_tok>\S+)        # or directly by the next token
            ))"""

    return KeepNewlines()


def pretrained_parameters(lang: str):
    """The installed Punkt model's parameters for ``lang``, or None when its data is missing."""
    from nltk.tokenize.punkt import PunktTokenizer

    try:
        return PunktTokenizer(lang)._params
    except (LookupError, ValueError, OSError):
        return None


class SentenceSplitter:
    """Callable text -> list of sentences; picklable (rebuilt from its settings)."""

    def __init__(self, keep_newlines: bool = False, lang: str = "english") -> None:
        self.keep_newlines = keep_newlines
        self.lang = lang
        self._build()

    def _build(self) -> None:
        from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

        params = pretrained_parameters(self.lang)
        self.pretrained = params is not None
        if params is None:
            params = PunktParameters()
        lang_vars = _newline_keeping_vars() if self.keep_newlines else None
        if lang_vars is None:
            self._punkt = PunktSentenceTokenizer(params)
        else:
            self._punkt = PunktSentenceTokenizer(params, lang_vars=lang_vars)

    @property
    def note(self) -> Optional[str]:
        if self.pretrained:
            return None
        return (f"nltk's Punkt model for {self.lang!r} is not installed (python -m nltk.downloader punkt_tab); "
                "splitting sentences with an untrained Punkt splitter")

    def __call__(self, text: str) -> list[str]:
        return [s for i in range(0, len(text), MAX_SPLIT_CHARS) for s in self._punkt.tokenize(text[i:i + MAX_SPLIT_CHARS])]

    def __getstate__(self):
        return {"keep_newlines": self.keep_newlines, "lang": self.lang}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._build()

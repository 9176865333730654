"""What an engine-core process imports before it can start: every rank of every launch pays it
(about 1 s less since the frontend, the grammar library, the tokenizer and transformers'
table of every architecture are left to the code that needs them)."""

from __future__ import annotations

from tests.import_check import modules_loaded_by

# Imported only by the frontend or on first use inside a core.
NOT_AT_START = ("widellm.engine.llm", "widellm.engine.arg_utils", "widellm.engine.tokenizer",
                "xgrammar", "transformers.models.auto.configuration_auto")


def test_engine_core_module_leaves_the_frontend_and_grammars_out():
    assert modules_loaded_by("import widellm.engine.core_proc", NOT_AT_START) == []


def test_the_public_names_still_import_from_the_package():
    import widellm
    from widellm import LLM, CompletionOutput, RequestOutput, SamplingParams
    from widellm.engine.llm import LLM as EngineLLM

    assert LLM is EngineLLM and SamplingParams.__name__ == "SamplingParams"
    assert (RequestOutput.__name__, CompletionOutput.__name__) == ("RequestOutput",
                                                                   "CompletionOutput")
    assert sorted(widellm.__all__) == ["CompletionOutput", "LLM", "RequestOutput",
                                       "SamplingParams"]

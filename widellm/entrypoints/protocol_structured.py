"""Request fields that constrain the output to a grammar: OpenAI's ``response_format`` and
vLLM's ``structured_outputs`` plus its older ``guided_*`` fields. A request may use one of
them; each becomes one ``StructuredOutputsParams``. A field or key we do not support is a 400
naming it (the models forbid unknown keys), never a silently unconstrained answer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from widellm.sampling_params import StructuredOutputsParams

# vLLM's names for the grammar engine a request may pick; widellm has one (xgrammar).
ACCEPTED_GUIDED_BACKENDS = ("auto", "xgrammar")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: StrictStr
    description: StrictStr | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    # OpenAI's strict mode; the output follows the schema exactly either way.
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` object: exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class StructuredOutputFields(BaseModel):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None

    def structured_outputs_source(self) -> str | None:
        """The request field that carries the constraint (for error messages)."""
        given = self._given()
        return given[0] if given else None

    def _given(self) -> list[str]:
        given = [name for name in ("structured_outputs", "guided_json", "guided_regex",
                                   "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        return given

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint this request asks for (None: none); ValueError naming the
        field when it asks for several or for something unsupported."""
        if self.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern: not supported; use "
                             "structured_outputs.disable_any_whitespace for compact JSON")
        backend = self.guided_decoding_backend
        if backend is not None and backend not in ACCEPTED_GUIDED_BACKENDS:
            raise ValueError(f"guided_decoding_backend: this server uses xgrammar; got "
                             f"{backend!r}")
        given = self._given()
        if len(given) > 1:
            raise ValueError(f"{given[1]}: give one structured output constraint; this "
                             f"request also has {given[0]}")
        if not given:
            return None
        source = given[0]
        if source == "response_format":
            fmt = self.response_format
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError("response_format: json_schema.schema is required for type "
                                 "json_schema")
            return StructuredOutputsParams(json=fmt.json_schema.json_schema)
        if source == "structured_outputs":
            so = self.structured_outputs
            return StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace)
        kind = source.removeprefix("guided_")
        try:
            return StructuredOutputsParams(**{kind: getattr(self, source)})
        except ValueError as e:
            raise ValueError(f"{source}: {str(e).split(': ', 1)[1]}") from None

"""Structured outputs: constrain what a request may generate to a grammar (a JSON schema, any
JSON object, a regex, a list of choices or an EBNF grammar).

Three halves, like the KV connector's: the frontend validates a request's constraint
(``validate.py``, a 400 naming the field); the engine core compiles it off the step loop
(``manager.py``) and admits the request once it is compiled; the model runner keeps one
matcher per running request, fills a token bitmask for the rows it samples and advances the
matchers with what it sampled (``runner_grammars.py``). The grammar engine sits behind
``backend.py`` (xgrammar is the first backend); ``bitmask.py`` applies a mask to logits,
with a plain torch twin the tests compare it with.
"""

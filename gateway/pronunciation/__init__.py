"""Pronunciation (issue 34): dictionaries of aliases, the inline markup subset, and the rewrite of a
sentence's written text into what the backend is given, with the map back to the client's words.

- `rules.py`: a dictionary's entries and their bounds;
- `matcher.py`: the entries in a trie, matched left to right in time linear in the text;
- `markup.py`: the markup subset (`text_markup: "ssml"`): spell, say-as, sub, break, expressions;
- `rewrite.py`: the rewrite of a text that may still be growing (held back only where a rule or a tag
  is not decided yet), and the map from spoken words back to written ones;
- `speech.py`: a sentence's synthesis through the rewrite: its parts, pauses as silence, word timings
  mapped back;
- `pronouncer.py`: a session's (or an HTTP request's) rules, the one object the session and routes use;
- `registry.py`: dictionaries registered by name per API key, in the session store.
"""

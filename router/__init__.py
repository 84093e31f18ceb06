"""Tokenizer-side boundary detection and its ZMQ messages to the schedulers.

- messages.py: SFIBoundariesReqInput / SFIBoundariesReqOutput (SGLang BaseReq structs)
- detector.py: boundary spec -> token tables (tokenizer side) and back (scheduler side)
- tokenizer_side.py: fan-out to every scheduler, HTTP /sfi/boundaries, Engine methods
- scheduler_side.py: the scheduler's dispatcher entry that installs a table
"""

"""The daemon's HTTP server: Ollama's and OpenAI's APIs over the scheduler (issue 29).

    server.py   listeners (TCP, the unix socket), who may ask what, errors in each API's shape
    common.py   request bodies, model references, one generation as a stream of replies
    ollama.py   /api/*: Ollama's API
    openai.py   /v1/*: OpenAI's API

ipc/ stays the wire of moed's own protocol and imports nothing from here.
"""

"""``qlm gateway``: an OpenAI-compatible HTTP front door onto qlm's durable queue.

Each ``/v1/completions`` or ``/v1/chat/completions`` call becomes one qlm ``RequestMessage``
published to ``qlm.ingress``; its one reply becomes the OpenAI response. See docs/gateway.md.

``qlm.gateway.app`` holds the server (``serve_gateway``, ``create_gateway_app``,
``GatewayClient``, ``GatewaySettings``); ``qlm.gateway.keys`` the API keys (``ApiKeys``, and
``ApiKeysWatch``, which rotates them from the key file); ``qlm.gateway.command`` the CLI
command.
Nothing is imported here, so that registering the command keeps ``qlm --help`` fast.
"""

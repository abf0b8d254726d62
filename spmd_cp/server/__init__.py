"""`spmd-cp serve`'s OpenAI-compatible HTTP side (rank 0): request checking and response
shapes (openai_api), the HTTP server and its handler threads (http_api), and the main
thread's queue of requests (root); every rank's request loops (serving). The command's
front end is spmd_cp/cli/serve.py."""

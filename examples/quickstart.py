import anthropic, recorder, replayer

@recorder.tool                                        # a tool call becomes an observation
def search(query: str) -> str: return f" [3 results for {query!r}]"

def agent() -> str:
    client = anthropic.Anthropic()                    # reads ANTHROPIC_BASE_URL and _API_KEY
    reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=512,
                                   messages=[{"role": "user", "content": "Fix the auth bug"}])
    return reply.content[0].text + search("session refresh")

with recorder.record("cassettes/demo/quickstart.jsonl", overwrite=True):  # live, signed
    agent()
with replayer.replay("cassettes/demo/quickstart.jsonl") as run:  # offline: no network
    agent()
print(run.result.report())                            # identical, or where it diverged

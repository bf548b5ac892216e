"""The word lists ``scripts/synthetic.py`` builds its vocabulary and templates from."""

from __future__ import annotations

NOUNS = """user order payment cache session token invoice queue worker job event ledger index shard
report batch schema config auth metric span trace retry limit quota tenant account webhook export
import sync snapshot backup migration feature flag price cart search embed vector graph node edge
route handler client server gateway proxy pool lock lease bucket blob stream topic partition offset
consumer producer email notification template render parser lexer build deploy release pipeline
stage artifact image container volume secret key cert dns ingress rate window timer clock scheduler
cron backfill ingest transform loader writer reader encoder decoder serializer validator policy role
permission audit log alert dashboard probe health status heartbeat upload download thumbnail
checkout refund subscription plan coupon catalog inventory warehouse shipment address profile avatar
comment thread message channel room presence cursor page query filter sort facet ranking score
model feature_store prompt completion chunk document summary digest manifest registry plugin
extension hook middleware adapter connector driver dialect transaction replica primary standby
failover quorum election leader follower segment compaction tombstone ttl eviction warmup""".split()

VERBS = """get set load save fetch build parse render sync flush compute resolve handle process
validate normalize encode decode merge split apply refresh rotate retry publish consume schedule
dispatch emit collect update delete create list find check open close start stop reset init
register upsert compact prune evict warm drain bind attach detach enqueue dequeue reconcile
migrate backfill snapshot restore export import serialize hydrate invalidate throttle""".split()

CLASS_SUFFIX = """Manager Service Client Handler Store Cache Worker Config Router Builder Factory Loader
Writer Reader Parser Registry Provider Adapter Controller Scheduler Pool Queue Index Monitor
Validator Serializer Resolver Gateway Policy Tracker Buffer Session Context Pipeline""".split()

TOOLS = """postgres redis kafka duckdb sqlite clickhouse elasticsearch opensearch rabbitmq nats
pytest ruff mypy black isort poetry uv pip docker kubernetes helm terraform ansible grafana
prometheus loki tempo sentry datadog celery dramatiq fastapi django flask starlette pydantic
sqlalchemy alembic react vite webpack esbuild typescript eslint prettier jest playwright cypress
nginx envoy traefik caddy github-actions gitlab-ci argo flux vault consul etcd minio s3 gcs
bigquery snowflake airflow dagster prefect spark ray dask polars pandas numpy pyarrow onnx
tokio axum serde cargo clippy gofmt golangci-lint protobuf grpc graphql openapi jwt oauth""".split()

LANGS = ["Python", "Go", "TypeScript", "Rust", "SQL", "Bash", "Java"]

FIRST_NAMES = """Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Karl Laura Mallory Niaj Olivia
Peggy Quentin Rupert Sybil Trent Uma Victor Wendy Xavier Yara Zane Amara Bilal Chen Dana Emeka
Farah Goran Hana Ines Jonas Kenji Lena Mateo Noor Oskar Priya Rafael Sana Tomas Ulla Vikram Wei
Yusuf Zofia Aiko Bruno Chiara Diego Elif Femi Gita Hugo Isla Jamal Kaia Liam Maya Nikhil Omar
Pia Ravi Sofia Tariq Valentina Yosef""".split()

PROJECT_NAMES = """atlas orion helios nimbus vega polaris zephyr quasar ember tundra lumen cobalt
sierra juniper falcon harbor meridian onyx pulsar raven sequoia titan umbra vertex willow
aurora basalt cinder delta echo fjord granite halcyon indigo jasper kestrel lynx magnet""".split()

ERROR_BASES = """Connection Timeout Key Value Type Attribute Import ModuleNotFound Permission
FileNotFound Integrity Operational Programming Validation Serialization Runtime NotImplemented
Index Lookup Memory Recursion Assertion BrokenPipe ConnectionReset Unicode Decode Schema Auth
RateLimit Quota Deadline Conflict Lock Stale Checksum Config Migration""".split()

STDLIB_ERRORS = [
    ("KeyError", "'{noun}_id'"),
    ("TypeError", "unsupported operand type(s) for +: 'NoneType' and 'int'"),
    ("AttributeError", "'NoneType' object has no attribute '{verb}'"),
    ("ValueError", "invalid literal for int() with base 10: '{noun}'"),
    ("ModuleNotFoundError", "No module named '{module}'"),
    ("ConnectionResetError", "[Errno 104] Connection reset by peer"),
    ("TimeoutError", "timed out after {n}s waiting for {noun} lock"),
    ("PermissionError", "[Errno 13] Permission denied: '{path}'"),
    ("FileNotFoundError", "[Errno 2] No such file or directory: '{path}'"),
    ("RecursionError", "maximum recursion depth exceeded while calling a Python object"),
    ("UnicodeDecodeError", "'utf-8' codec can't decode byte 0x{hexb} in position {n}: invalid start byte"),
    ("sqlalchemy.exc.IntegrityError", "duplicate key value violates unique constraint \"{noun}_{noun2}_key\""),
    ("psycopg2.OperationalError", "could not connect to server: Connection refused"),
    ("redis.exceptions.ConnectionError", "Error 111 connecting to localhost:{port}. Connection refused."),
    ("json.decoder.JSONDecodeError", "Expecting value: line 1 column {n} (char {n2})"),
    ("asyncio.CancelledError", ""),
    ("OSError", "[Errno 28] No space left on device"),
    ("MemoryError", ""),
]

GENERIC_REASONS = [
    "it removes a network hop on the hot path",
    "the old approach leaked connections under load",
    "it was the only option with a stable API",
    "the team already knows it well",
    "benchmarks showed it was {n}x faster on our data",
    "it keeps the deploy a single binary",
    "we kept hitting the rate limit otherwise",
    "it makes retries idempotent",
    "the previous library is unmaintained",
    "it halves memory at peak",
    "support for it ends next quarter",
    "it simplifies local development",
    "on-call kept getting paged for it",
    "it lets us test without docker",
    "p99 latency dropped from {n}00ms to {n}0ms",
]

FILLER = [
    "This matters because the {noun} {noun2} path depends on it.",
    "{person} reviewed the change in PR #{pr}.",
    "Tests in {test_path} cover the {noun} case now.",
    "We saw the same thing again after the {noun} refactor.",
    "Note that {env} must be set in staging as well.",
    "The old behaviour came from {path}.",
    "It only shows up when {noun} traffic is high.",
    "{person} asked to keep this in mind for the next release.",
    "Rolling back did not help, so we kept the fix.",
    "The dashboard for {svc} shows the drop clearly.",
    "There is a follow-up ticket {ticket} for the cleanup.",
    "Remember to bump {config_key} if the batch grows.",
    "We should document this in the {project} README.",
    "It was reproduced locally with {tool} {ver}.",
    "The root cause was a missing index on {noun}_{noun2}.",
    "{func}() is called from three places, all in {svc}.",
    "After the fix the error rate went back under {n} per hour.",
    "Nobody remembered why {class_} was written that way.",
    "The workaround is ugly but safe until the migration lands.",
    "Logs are in {svc}'s {noun} channel if it happens again.",
    "I think we can drop the {noun} shim once {svc} is upgraded.",
    "It took about {n} minutes to find.",
    "Make sure {func}() stays idempotent.",
    "{person} confirmed it works on {lang} {ver} too.",
    "The config default was wrong for a long time.",
    "Same pattern exists in {path2}, worth checking.",
    "We agreed not to touch the {noun} schema this sprint.",
    "The flaky test was {test_func}, not the code.",
]

STYLE_PREFS = [
    "type hints on every public function", "early returns over nested ifs", "small pure functions",
    "dataclasses instead of dicts", "f-strings, never % formatting", "explicit imports, no star imports",
    "tests next to the code", "one assertion per test", "structured logging with keys",
    "no mocks for the database", "snake_case file names", "squash merges", "conventional commit messages",
    "short PRs under 300 lines", "docstrings in Google style", "tabs never spaces", "4-space indents",
    "async only at the edges", "pathlib over os.path", "errors that say what to do next",
]

VAGUE = [
    "that deploy issue", "the flaky test", "what did we decide", "the error from last week",
    "auth problem", "why is it slow", "the migration thing", "where is the config",
    "what broke in staging", "the cache bug", "how do I run it", "what did {person} say",
    "the timeout again", "the thing with the queue", "port for the api", "remind me about the release",
    "what's the workaround", "how did we fix it", "what was the plan", "memory leak",
]

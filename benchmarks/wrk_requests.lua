-- wrk script of benchmarks/loadgen.py: each thread cycles through the requests written in the
-- folder $WRK_REQUESTS, from an offset of its own, and done() prints one JSON line of figures.
--   requests.bin  the bodies, back to back
--   requests.tsv  one line per request: path, body length in bytes, then "Name: value" headers
-- The requests are formatted once per thread: wrk then only writes them (its cost per request
-- is that of a C client).
local folder = assert(os.getenv("WRK_REQUESTS"), "WRK_REQUESTS names the requests' folder")
local file = assert(io.open(folder .. "/requests.bin", "rb"))
local blob = file:read("*a")
file:close()

-- (path, headers, body) of each request; formatted in init(), once wrk has set the Host header
local parts = {}
local at = 1
for line in io.lines(folder .. "/requests.tsv") do
  local fields = {}
  for field in string.gmatch(line, "[^\t]+") do
    fields[#fields + 1] = field
  end
  local length = tonumber(fields[2])
  local headers = {}
  for i = 3, #fields do
    local name, value = string.match(fields[i], "^([^:]+):%s*(.*)$")
    headers[name] = value
  end
  parts[#parts + 1] = {fields[1], headers, string.sub(blob, at, at + length - 1)}
  at = at + length
end

local requests = {}
function init(_)
  for i, part in ipairs(parts) do
    requests[i] = wrk.format("POST", part[1], part[2], part[3])
  end
end

local threads = 0
function setup(thread)
  thread:set("offset", threads * 7919)
  threads = threads + 1
end

local sent = 0
function request()
  sent = sent + 1
  return requests[(offset + sent) % #requests + 1]
end

function done(summary, latency, _)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, "status": %d, ' ..
    '"timeout": %d, "p50_us": %d, "p99_us": %d, "max_us": %d}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.max))
end

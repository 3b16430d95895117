-- wrk script for bench_serve.py: POST one prepared inference request, closed loop.
--
--   wrk -t1 -c N -d 3s --latency -s serve_wrk.lua URL -- BODY_FILE [HEADER_LENGTH]
--
-- BODY_FILE holds the whole request body. With HEADER_LENGTH (the byte length
-- of its JSON header) the body is sent as Triton's binary tensor extension
-- (Inference-Header-Content-Length); without it, as plain JSON.
-- done() prints one line, "WRK_RESULT {json}", that bench_serve.py parses.

local request_bytes

function init(args)
   local f = assert(io.open(args[1], "rb"), "cannot open the body file " .. tostring(args[1]))
   local body = f:read("*all")
   f:close()
   local headers = {}
   if args[2] ~= nil and args[2] ~= "" then
      headers["Content-Type"] = "application/octet-stream"
      headers["Inference-Header-Content-Length"] = args[2]
   else
      headers["Content-Type"] = "application/json"
   end
   -- Formatted once: every request is the same bytes.
   request_bytes = wrk.format("POST", nil, headers, body)
end

function request()
   return request_bytes
end

function done(summary, latency, requests)
   local seconds = summary.duration / 1e6
   local e = summary.errors
   io.write(string.format(
      'WRK_RESULT {"requests": %d, "seconds": %.6f, "rps": %.3f, "p50_us": %d, "p90_us": %d, "p99_us": %d, '
         .. '"mean_us": %.3f, "max_us": %d, "errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}}\n',
      summary.requests, seconds, summary.requests / seconds, latency:percentile(50), latency:percentile(90),
      latency:percentile(99), latency.mean, latency.max, e.connect, e.read, e.write, e.status, e.timeout))
end

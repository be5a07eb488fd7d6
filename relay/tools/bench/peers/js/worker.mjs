// The Graphile Worker peer of `relay bench` (relay/tools/bench/peers/graphile.py starts it).
//
// One process, two phases, one JSON line on stdout at the end:
//   1. add: migrate the graphile_worker schema, then add one job per line of `config.jobs`
//      (a JSONL file of ingress bodies, one event each) with WorkerUtils.addJobs, one call
//      (one statement, so one transaction) per `config.chunk` jobs, queueName = run_id.
//   2. run: start a worker (`run()`) with the settings of `config`, and time from that call
//      to the moment the last job's POST was answered; then stop it gracefully (which also
//      flushes batched completions) and report.
// The task POSTs the job's payload to the sink with Node's built-in fetch; its default
// dispatcher (undici) keeps connections alive and opens as many as there are jobs in flight.

import { readFileSync } from "node:fs";
import { performance } from "node:perf_hooks";

import { Logger, makeWorkerUtils, run } from "graphile-worker";

const config = JSON.parse(process.argv[2]);

// Warnings and errors to stderr; Graphile's info lines (one per worker) would be noise.
const logger = new Logger((scope) => (level, message) => {
  if (level === "error" || level === "warning") {
    process.stderr.write(`[graphile ${level}] ${message}\n`);
  }
});

const shared = { connectionString: config.url, schema: config.schema, logger };

// With `staggerRunAt`, every job gets its own run_at, one millisecond apart and increasing in
// file order (each run's events are in seq order there), all in the past: jobs added by one
// addJobs call would otherwise share one run_at, and a local queue's batched fetch returns the
// jobs of a named queue in run_at order, so ties could come back out of order.
async function addAll() {
  const lines = readFileSync(config.jobs, "utf8")
    .split("\n")
    .filter((line) => line.length > 0);
  const base = Date.now() - lines.length - 1000;
  const specs = lines.map((line, i) => {
    const body = JSON.parse(line);
    const spec = { identifier: "post_event", payload: body, queueName: body.run_id };
    return config.staggerRunAt ? { ...spec, runAt: new Date(base + i) } : spec;
  });
  const utils = await makeWorkerUtils(shared);
  try {
    await utils.migrate();
    for (let lo = 0; lo < specs.length; lo += config.chunk) {
      await utils.addJobs(specs.slice(lo, lo + config.chunk));
    }
  } finally {
    await utils.release();
  }
  return specs.length;
}

async function main() {
  const total = await addAll();
  const headers = { "content-type": "application/json", "relay-lease-epoch": "1" };
  let done = 0;
  let lastDone = 0;
  let failed = 0;
  let finished;
  const allDone = new Promise((resolve) => {
    finished = resolve;
  });

  const taskList = {
    post_event: async (payload) => {
      const response = await fetch(`${config.sink}/runs/${encodeURIComponent(payload.run_id)}/events`, {
        method: "POST",
        headers,
        body: JSON.stringify(payload),
      });
      await response.arrayBuffer(); // read to the end, so the connection goes back to the pool
      if (response.status !== 200) {
        throw new Error(`the sink answered ${response.status}`);
      }
      done += 1;
      if (done === total) {
        lastDone = performance.now();
        finished();
      }
    },
  };

  const started = performance.now();
  const runner = await run({
    ...shared,
    concurrency: config.concurrency,
    pollInterval: config.pollInterval,
    noHandleSignals: true,
    taskList,
    preset: {
      worker: {
        maxPoolSize: config.maxPoolSize,
        localQueue: { size: config.localQueueSize },
        completeJobBatchDelay: config.completeJobBatchDelay,
        failJobBatchDelay: config.completeJobBatchDelay,
      },
    },
  });
  runner.events.on("job:failed", () => {
    failed += 1;
  });
  const timeout = setTimeout(() => finished(), config.timeoutMs);
  await allDone;
  clearTimeout(timeout);
  await runner.stop();
  await runner.promise;
  const out = { jobs: total, done, failed, seconds: (lastDone - started) / 1000 };
  process.stdout.write(`${JSON.stringify(out)}\n`);
  process.exit(done === total ? 0 : 3);
}

main().catch((error) => {
  process.stderr.write(`${error && error.stack ? error.stack : error}\n`);
  process.exit(2);
});

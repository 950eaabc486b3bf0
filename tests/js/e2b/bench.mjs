// The JavaScript SDK's side of benchmarks/e2b.py: for each "go" line on stdin, Sandbox.create()
// then runCode("print(2 + 2)"), timed here; one JSON line back per sample (the sandbox is killed
// after, untimed). The benchmark paces the samples (it waits for an idle warm pool first).
import { createInterface } from 'node:readline'
import { Sandbox } from '@e2b/code-interpreter'

for await (const line of createInterface({ input: process.stdin })) {
  if (line.trim() !== 'go') break
  const t0 = performance.now()
  const sb = await Sandbox.create()
  const t1 = performance.now()
  const execution = await sb.runCode('print(2 + 2)')
  const t2 = performance.now()
  await sb.kill()
  process.stdout.write(JSON.stringify({ total_ms: t2 - t0, create_ms: t1 - t0, stdout: execution.logs.stdout }) + '\n')
}
process.exit(0) // the SDK's kept-alive connections would hold node up

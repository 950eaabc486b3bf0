// The unmodified E2B JavaScript SDK pauses a sandbox and connects to it again: the state kept
// by the pause (a session snapshot) is there after it. Run by tests/test_e2b_pause.py, which
// starts a server with a snapshot store and points the SDK at it (E2B_API_URL,
// E2B_SANDBOX_URL, E2B_API_KEY). Exits non-zero, with the assertion, on any difference.

import assert from 'node:assert/strict'
import { NotFoundError, Sandbox } from '@e2b/code-interpreter'

const sb = await Sandbox.create({ timeoutMs: 600_000 })
try {
  await sb.runCode('kept = 41')
  assert.equal(await sb.pause(), true)
  assert.equal((await sb.getInfo()).state, 'paused')
  assert.equal(await Sandbox.pause(sb.sandboxId), false) // the SDK's answer: paused already
  await assert.rejects(() => sb.runCode('kept'), NotFoundError) // no jail to reach while paused
  const again = await Sandbox.connect(sb.sandboxId)
  assert.equal(again.sandboxId, sb.sandboxId)
  assert.equal((await again.getInfo()).state, 'running')
  assert.equal((await again.runCode('kept + 1')).text, '42')
} finally {
  await sb.kill()
}
console.log('ok')
process.exit(0) // the SDK's keep-alive connections would hold node open for a minute

// The unmodified E2B JavaScript SDK (@e2b/code-interpreter, pinned in package-lock.json) against
// a real appliance: the scenarios of tests/e2b_scenarios.py, under the same names.
//
// tests/test_e2b_js.py starts the server and runs this file with node, pointing the SDK at it
// the way docs/e2b.md tells a user (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY). Each scenario's
// outcome is one JSON line appended to $E2B_TEST_REPORT: {"name", "ok", "error"?}.
// Arguments, if any, name the scenarios to run (default: all).

import { appendFileSync } from 'node:fs'
import { request as httpRequest } from 'node:http'
import assert from 'node:assert/strict'
import {
  AuthenticationError,
  CommandExitError,
  NotFoundError,
  RateLimitError,
  Sandbox,
  SandboxError,
  TimeoutError,
} from '@e2b/code-interpreter'

const OTHER_KEY = process.env.E2B_TEST_OTHER_KEY // another tenant's key
const LIMITED_KEY = process.env.E2B_TEST_LIMITED_KEY // a tenant allowed one session
const SCALE = Number(process.env.E2B_TEST_SCALE || '1') // tests/support.py's SCALE
const REPORT = process.env.E2B_TEST_REPORT

const randomTag = () => Math.random().toString(16).slice(2, 14)

// Poll check until it holds (true) or the scaled deadline passes (its last answer).
async function until(check, withinS = 20) {
  const deadline = Date.now() + withinS * 1000 * SCALE
  while (Date.now() < deadline) {
    if (await check()) return true
    await new Promise((resolve) => setTimeout(resolve, 100))
  }
  return check()
}

async function raises(kind, fn) {
  try {
    await fn()
  } catch (err) {
    assert.ok(err instanceof kind, `expected ${kind.name}, got ${err?.constructor?.name}: ${err?.message}`)
    return err
  }
  assert.fail(`expected ${kind.name}, nothing was raised`)
}

async function withSandbox(fn, opts = {}) {
  const sb = await Sandbox.create(opts)
  try {
    return await fn(sb)
  } finally {
    await sb.kill()
  }
}

const scenarios = {
  async create_info_list_kill() {
    const tag = randomTag()
    const sb = await Sandbox.create({ metadata: { tag, kind: 'test' }, timeoutMs: 120_000 })
    try {
      const info = await sb.getInfo()
      assert.equal(info.sandboxId, sb.sandboxId)
      assert.deepEqual(info.metadata, { tag, kind: 'test' })
      assert.equal(info.templateId, 'code-interpreter-v1')
      const lifeS = (info.endAt - info.startedAt) / 1000
      assert.ok(lifeS >= 110 && lifeS <= 120, `lifetime ${lifeS} s`)
      const listed = await Sandbox.list({ query: { metadata: { tag } } }).nextItems()
      assert.deepEqual(listed.map((s) => s.sandboxId), [sb.sandboxId])
      assert.deepEqual(await Sandbox.list({ query: { metadata: { tag, kind: 'other' } } }).nextItems(), [])
      assert.equal(await sb.isRunning(), true)
    } finally {
      await sb.kill()
    }
    assert.equal(await sb.isRunning(), false)
    await raises(NotFoundError, () => Sandbox.getInfo(sb.sandboxId))
    await raises(NotFoundError, () => Sandbox.connect(sb.sandboxId))
    await raises(NotFoundError, () => Sandbox.getInfo('no-such-sandbox-0123'))
    assert.equal(await Sandbox.kill(sb.sandboxId), false) // the SDK's answer for a sandbox not there
  },

  async list_pages_through_every_sandbox_once() {
    const tag = randomTag()
    const made = []
    try {
      for (let i = 0; i < 3; i++) made.push(await Sandbox.create({ metadata: { page: tag } }))
      const paginator = Sandbox.list({ query: { metadata: { page: tag } }, limit: 2 })
      const pages = []
      while (paginator.hasNext) pages.push((await paginator.nextItems()).map((s) => s.sandboxId))
      assert.deepEqual(pages.map((p) => p.length), [2, 1])
      assert.deepEqual(pages.flat().sort(), made.map((s) => s.sandboxId).sort())
    } finally {
      for (const sb of made) await sb.kill()
    }
  },

  async timeout_ends_the_sandbox_and_set_timeout_moves_it() {
    const sb = await Sandbox.create({ timeoutMs: 3_600_000 })
    await sb.setTimeout(3000) // not 1 s: the info is read before it ends, even on a stalled machine
    const info = await sb.getInfo()
    assert.ok((info.endAt - info.startedAt) / 1000 < 60)
    assert.ok(await until(async () => !(await sb.isRunning())), 'the sandbox outlived its timeout')
    await raises(NotFoundError, () => sb.runCode('1'))
    await raises(NotFoundError, () => sb.setTimeout(10_000))
  },

  async connect_reaches_the_same_interpreter() {
    await withSandbox(async (sb) => {
      await sb.runCode("kept = 'across connections'")
      const again = await Sandbox.connect(sb.sandboxId)
      assert.equal((await again.runCode('kept')).text, "'across connections'")
    })
  },

  async run_code_streams_to_callbacks() {
    await withSandbox(async (sb) => {
      const out = []
      const err = []
      const results = []
      const execution = await sb.runCode("import sys\nprint('hello')\nprint('warn', file=sys.stderr)\n6 * 7", {
        onStdout: (m) => out.push(m.line),
        onStderr: (m) => err.push(m.line),
        onResult: (r) => results.push(r.text),
      })
      assert.equal(out.join(''), 'hello\n')
      assert.equal(err.join(''), 'warn\n')
      assert.deepEqual(results, ['42'])
      assert.equal(execution.text, '42')
      assert.equal(execution.results[0].isMainResult, true)
      assert.deepEqual(execution.logs.stdout, ['hello\n'])
      assert.equal(execution.executionCount, 1)
      assert.equal((await sb.runCode('1')).executionCount, 2)
    })
  },

  async matplotlib_png() {
    await withSandbox(async (sb) => {
      const execution = await sb.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()')
      assert.equal(execution.error, undefined, JSON.stringify(execution.error))
      const pngs = execution.results.filter((r) => r.png).map((r) => r.png)
      assert.equal(pngs.length, 1)
      const bytes = Buffer.from(pngs[0], 'base64')
      assert.deepEqual([...bytes.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])
    })
  },

  async dataframe_html() {
    await withSandbox(async (sb) => {
      const execution = await sb.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
      assert.equal(execution.error, undefined, JSON.stringify(execution.error))
      const result = execution.results[0]
      assert.equal(result.isMainResult, true)
      assert.ok(result.html?.includes('<table'), result.html)
      assert.ok(result.text?.includes('a'), result.text)
      assert.ok(result.formats().includes('html'), result.formats())
    })
  },

  async an_error_comes_back_typed() {
    await withSandbox(async (sb) => {
      const seen = []
      const execution = await sb.runCode('def f():\n    return 1 / 0\nf()', { onError: (e) => seen.push(e) })
      assert.ok(execution.error)
      assert.equal(execution.error.name, 'ZeroDivisionError')
      assert.equal(execution.error.value, 'division by zero')
      assert.ok(execution.error.traceback.includes('return 1 / 0'), execution.error.traceback)
      assert.deepEqual(seen, [execution.error])
    })
  },

  async state_across_calls_and_separate_contexts() {
    await withSandbox(async (sb) => {
      await sb.runCode('x = 41')
      assert.equal((await sb.runCode('x + 1')).text, '42')
      const ctx = await sb.createCodeContext()
      assert.equal(ctx.language, 'python')
      const missing = await sb.runCode('x', { context: ctx })
      assert.equal(missing.error?.name, 'NameError')
      await sb.runCode("x = 'other'", { context: ctx })
      assert.equal((await sb.runCode('x')).text, '41')
      assert.ok((await sb.listCodeContexts()).map((c) => c.id).includes(ctx.id))
      await sb.restartCodeContext(ctx)
      assert.ok((await sb.runCode('x', { context: ctx })).error, 'a restart forgets')
      await sb.removeCodeContext(ctx)
      assert.ok(!(await sb.listCodeContexts()).map((c) => c.id).includes(ctx.id))
      await raises(NotFoundError, () => sb.runCode('1', { context: ctx }))
    })
  },

  async env_vars_of_the_sandbox_and_of_one_call() {
    await withSandbox(
      async (sb) => {
        assert.equal((await sb.runCode("import os\nos.environ['GREETING']")).text, "'hello'")
        const once = await sb.runCode("os.environ['GREETING']", { envs: { GREETING: 'once', EXTRA: '1' } })
        assert.equal(once.text, "'once'")
        assert.equal(once.executionCount, 2) // the server's own cells are not counted
        const after = await sb.runCode("os.environ['GREETING'], os.environ.get('EXTRA')")
        assert.equal(after.text, "('hello', None)")
      },
      { envs: { GREETING: 'hello' } },
    )
  },

  async two_sandboxes_are_isolated() {
    const one = await Sandbox.create()
    const two = await Sandbox.create()
    try {
      await one.runCode("secret = 'one'\nopen('mine.txt', 'w').write('one')")
      assert.ok((await two.runCode('secret')).error)
      const seen = (await two.runCode("import os\nos.path.exists('mine.txt'), sorted(os.environ)")).text
      assert.ok(seen?.startsWith('(False,'), seen)
      assert.ok(!seen.includes('SANDBOX_AUTH_TOKENS_FILE') && !seen.includes('E2B_API_KEY'), seen)
      // another tenant's sandbox reads as missing
      await raises(NotFoundError, () => Sandbox.getInfo(one.sandboxId, { apiKey: OTHER_KEY }))
    } finally {
      await one.kill()
      await two.kill()
    }
  },

  async a_wrong_key_is_refused() {
    const apiKey = 'not-a-tenant-token-at-all'
    await raises(AuthenticationError, () => Sandbox.create({ apiKey }))
    await raises(AuthenticationError, () => Sandbox.list({ apiKey }).nextItems())
  },

  async unknown_template_lists_the_templates() {
    const err = await raises(SandboxError, () => Sandbox.create('no-such-template'))
    assert.ok(err.message.includes('code-interpreter-v1') && err.message.includes('base'), err.message)
  },

  async other_languages_name_what_is_supported() {
    await withSandbox(async (sb) => {
      let err = await raises(SandboxError, () => sb.runCode('console.log(1)', { language: 'javascript' }))
      assert.ok(err.message.includes('python'), err.message)
      err = await raises(SandboxError, () => sb.createCodeContext({ language: 'r' }))
      assert.ok(err.message.includes('python'), err.message)
    })
  },

  async pause_and_snapshots_say_not_supported() {
    await withSandbox(async (sb) => {
      let err = await raises(SandboxError, () => sb.pause())
      assert.ok(err.message.includes('pause is not supported'), err.message)
      err = await raises(SandboxError, () => sb.createSnapshot())
      assert.ok(err.message.includes('snapshots is not supported'), err.message)
    })
  },

  async a_run_code_timeout_raises_and_the_context_lives_on() {
    await withSandbox(async (sb) => {
      await sb.runCode('kept = 1')
      await raises(TimeoutError, () => sb.runCode('import time\ntime.sleep(60)', { timeoutMs: 1000 }))
      const answers = async () => {
        // the cell is interrupted once the server sees the client gone
        try {
          return (await sb.runCode('kept')).text === '1'
        } catch (err) {
          if (err instanceof SandboxError) return false // still busy with the interrupted cell
          throw err
        }
      }
      assert.ok(await until(answers), 'the context did not come back')
    })
  },

  async a_tenant_quota_applies() {
    const first = await Sandbox.create({ apiKey: LIMITED_KEY })
    try {
      // max_sessions = 1. Our 429 carries Retry-After, which the SDK answers by retrying with
      // Request.clone(); under node's bundled undici (6.19.8 on) that clone throws
      // `TypeError: unusable` once the clone sent last has been garbage-collected, as it can
      // be during the wait (docs/e2b.md). retries: 0 asks for the refusal itself.
      await raises(RateLimitError, () => Sandbox.create({ apiKey: LIMITED_KEY, retries: 0 }))
      await raises(SandboxError, () => first.createCodeContext()) // a context is a session too
    } finally {
      await first.kill()
    }
  },

  async calls_on_one_context_take_turns_and_keep_their_env_vars() {
    await withSandbox(async (sb) => {
      await sb.runCode('import os, time\nseen = []')
      const code = "time.sleep(0.2)\nseen.append(os.environ.get('WHO'))\nos.environ.get('WHO')"
      const texts = await Promise.all(['a', 'b', 'c', 'd'].map(async (who) => (await sb.runCode(code, { envs: { WHO: who } })).text))
      assert.deepEqual(texts, ["'a'", "'b'", "'c'", "'d'"]) // each cell saw its own call's value
      assert.equal((await sb.runCode('sorted(seen)')).text, "['a', 'b', 'c', 'd']")
      assert.equal((await sb.runCode("'WHO' in os.environ")).text, 'False')
    })
  },

  async files_round_trip() {
    await withSandbox(async (sb) => {
      const written = await sb.files.write('/home/user/rt/hello.txt', 'héllo')
      assert.equal(written.path, '/home/user/rt/hello.txt')
      assert.equal(await sb.files.read('rt/hello.txt'), 'héllo') // relative paths are /home/user's
      const bytes = new Uint8Array(70_000).map((_, i) => i % 251)
      await sb.files.write('rt/blob.bin', bytes)
      assert.deepEqual(Buffer.from(await sb.files.read('rt/blob.bin', { format: 'bytes' })), Buffer.from(bytes))
      await sb.files.write([{ path: 'rt/m/1.txt', data: '1' }, { path: '/home/user/rt/m/2.txt', data: '2' }])
      const listed = (await sb.files.list('rt', { depth: 2 })).map((e) => e.path).sort()
      assert.deepEqual(listed, ['/home/user/rt/blob.bin', '/home/user/rt/hello.txt', '/home/user/rt/m', '/home/user/rt/m/1.txt', '/home/user/rt/m/2.txt'])
      assert.equal(await sb.files.makeDir('rt/d/e'), true)
      assert.equal(await sb.files.makeDir('rt/d/e'), false)
      assert.equal((await sb.files.getInfo('rt/d')).type, 'dir')
      await sb.files.rename('rt/d', 'rt/d2')
      assert.equal(await sb.files.exists('rt/d'), false)
      await sb.files.remove('rt/d2')
      assert.equal(await sb.files.exists('rt/d2'), false)
      const seen = []
      const watch = await sb.files.watchDir('/home/user/rt', (e) => seen.push(e.name))
      await sb.runCode("open('rt/by-code.txt', 'w').write('from run_code')")
      assert.ok(await until(() => seen.includes('by-code.txt')), `watched: ${seen}`)
      await watch.stop()
      assert.equal(await sb.files.read('rt/by-code.txt'), 'from run_code')
      assert.equal((await sb.runCode("open('rt/hello.txt').read()")).text, "'héllo'")
      await raises(SandboxError, () => sb.files.read('/etc/passwd'))
    })
  },

  async commands_foreground_background_stdin_kill() {
    await withSandbox(async (sb) => {
      const out = []
      const err = []
      const result = await sb.commands.run('echo out; echo err >&2', {
        onStdout: (d) => out.push(d),
        onStderr: (d) => err.push(d),
      })
      assert.deepEqual([result.exitCode, result.stdout, result.stderr], [0, 'out\n', 'err\n'])
      assert.equal(out.join(''), 'out\n')
      assert.equal(err.join(''), 'err\n')
      const failed = await raises(CommandExitError, () => sb.commands.run('exit 3'))
      assert.equal(failed.exitCode, 3)
      const cat = await sb.commands.run('cat', { background: true, stdin: true })
      await sb.commands.sendStdin(cat.pid, 'typed\n')
      assert.ok((await sb.commands.list()).some((p) => p.pid === cat.pid))
      assert.equal(await sb.commands.kill(cat.pid), true)
      const killed = await raises(CommandExitError, () => cat.wait())
      assert.equal(killed.exitCode, 137)
      assert.ok(!(await sb.commands.list()).some((p) => p.pid === cat.pid))
    })
  },

  async a_server_in_the_sandbox_is_reached_through_get_host() {
    await withSandbox(async (sb) => {
      await sb.commands.run('echo served > index.html')
      await sb.commands.run('python -m http.server 8000 --bind 127.0.0.1', { background: true })
      const base = new URL(process.env.E2B_API_URL)
      const headers = { host: sb.getHost(8000), 'e2b-traffic-access-token': sb.trafficAccessToken ?? '' }
      const served = () =>
        new Promise((resolve) => {
          const req = httpRequest(
            { hostname: base.hostname, port: base.port, path: '/index.html', headers, timeout: 10_000 },
            (res) => {
              let body = ''
              res.on('data', (chunk) => (body += chunk))
              res.on('end', () => resolve(body === 'served\n'))
            },
          )
          req.on('error', () => resolve(false))
          req.end()
        })
      assert.ok(await until(served), 'the server was not reached through get_host')
    })
  },
}

function report(line) {
  const text = JSON.stringify(line) + '\n'
  if (REPORT) appendFileSync(REPORT, text)
  else process.stdout.write(text)
}

const only = process.argv.slice(2)
const unknown = only.filter((name) => !(name in scenarios))
if (unknown.length) {
  console.error(`unknown scenario(s): ${unknown.join(', ')}`)
  process.exit(2)
}
report({ scenarios: Object.keys(scenarios) })
for (const [name, run] of Object.entries(scenarios)) {
  if (only.length && !only.includes(name)) continue
  const started = Date.now()
  try {
    await run()
    report({ name, ok: true, ms: Date.now() - started })
  } catch (err) {
    report({ name, ok: false, ms: Date.now() - started, error: String(err?.stack || err) })
  }
}
// The SDK's HTTP agent keeps its idle connections, which would hold node up to the server's
// keep-alive timeout.
process.exit(0)

// The unmodified npm `e2b` SDK against boxd's E2B listener, under node's test runner.
// tests/integration/test_e2b_js.py starts a gVisor daemon and passes, besides E2B's own
// E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY (from `boxd e2b env`):
//   E2B_OTHER_API_KEY  a key of another account (its sandboxes are not ours: 404)
//   E2B_FULL_API_KEY   a key of an account whose machine quota is full (429)
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'

import {
  AuthenticationError,
  CommandExitError,
  FilesystemEventType,
  NotFoundError,
  RateLimitError,
  Sandbox,
  SandboxError,
  SandboxNotFoundError,
  TimeoutError,
} from 'e2b'

for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY', 'E2B_OTHER_API_KEY',
  'E2B_FULL_API_KEY']) {
  assert.ok(process.env[name], `${name} is not set: run through tests/integration/test_e2b_js.py`)
}
const other = { apiKey: process.env.E2B_OTHER_API_KEY }

describe('one sandbox', () => {
  let sbx
  before(async () => {
    sbx = await Sandbox.create({ timeoutMs: 600_000, metadata: { suite: 'e2b-js' },
      envs: { GREETING: 'hi' } })
  })
  after(async () => {
    await sbx?.kill().catch(() => {})
  })

  test('create answers E2B fields', () => {
    assert.match(sbx.sandboxId, /^[a-z0-9]+$/)
    assert.ok(sbx.sandboxDomain === undefined || typeof sbx.sandboxDomain === 'string')
  })

  test('commands.run in the foreground: stdout, stderr, envs, cwd, exit codes', async () => {
    const r = await sbx.commands.run('echo $GREETING; echo oops >&2')
    assert.deepEqual([r.stdout, r.stderr, r.exitCode], ['hi\n', 'oops\n', 0])
    assert.equal((await sbx.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n')
    assert.equal((await sbx.commands.run('echo $X', { envs: { X: 'per-call' } })).stdout,
      'per-call\n')
    await assert.rejects(sbx.commands.run('echo partial; exit 3'), (err) => {
      assert.ok(err instanceof CommandExitError, `${err}`)
      assert.equal(err.exitCode, 3)
      assert.equal(err.stdout, 'partial\n')
      return true
    })
  })

  test('users: E2B\'s user by default, root when named; files are the call\'s user\'s', async () => {
    assert.equal((await sbx.commands.run('whoami; echo $HOME')).stdout, 'user\n/home/user\n')
    assert.equal((await sbx.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
    await sbx.files.write('jsowned/a.txt', 'x')
    await sbx.files.write('/home/user/jsowned/r.txt', 'x', { user: 'root' })
    assert.equal((await sbx.commands.run('stat -c %U jsowned jsowned/a.txt jsowned/r.txt'))
      .stdout, 'user\nuser\nroot\n')
    assert.equal((await sbx.files.getInfo('jsowned/a.txt')).owner, 'user')
    await assert.rejects(sbx.commands.run('true', { user: 'no-such-user' }), AuthenticationError)
    await assert.rejects(sbx.files.write('jsowned/n.txt', 'x', { user: 'no-such-user' }),
      AuthenticationError)
    await sbx.files.remove('jsowned')
  })

  test('streaming callbacks get output as it comes', async () => {
    const out = []
    const err = []
    const seen = []
    const r = await sbx.commands.run(
      'for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.3; done',
      {
        onStdout: (d) => { out.push(d); seen.push(Date.now()) },
        onStderr: (d) => { err.push(d) },
      })
    assert.equal(out.join(''), 'out1\nout2\nout3\n')
    assert.equal(err.join(''), 'err1\nerr2\nerr3\n')
    assert.equal(r.stdout, 'out1\nout2\nout3\n')
    // streamed, not one lump at the end: the first line came well before the last
    assert.ok(seen.length >= 2 && seen.at(-1) - seen[0] >= 300, `chunks at ${seen}`)
  })

  test('background commands: list, wait, kill, connect', async () => {
    const h = await sbx.commands.run('sleep 60', { background: true })
    assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid))
    assert.equal(await sbx.commands.kill(h.pid), true)
    await assert.rejects(h.wait(), CommandExitError)
    assert.ok(!(await sbx.commands.list()).some((p) => p.pid === h.pid))
    assert.equal(await sbx.commands.kill(h.pid), false)

    const lines = []
    const bg = await sbx.commands.run('sleep 1; echo done', { background: true,
      onStdout: (d) => { lines.push(d) } })
    const again = await sbx.commands.connect(bg.pid)
    assert.equal((await again.wait()).stdout, 'done\n')
    assert.equal((await bg.wait()).stdout, 'done\n')
    assert.equal(lines.join(''), 'done\n')
  })

  test('sendStdin, closeStdin; an unknown pid is NotFoundError', async () => {
    const h = await sbx.commands.run('cat; echo done', { background: true, stdin: true })
    await sbx.commands.sendStdin(h.pid, 'hello\n')
    await sbx.commands.sendStdin(h.pid, new Uint8Array([0x62, 0x79, 0x74, 0x65, 0x73, 0x0a]))
    await sbx.commands.closeStdin(h.pid)
    assert.equal((await h.wait()).stdout, 'hello\nbytes\ndone\n')
    await assert.rejects(sbx.commands.sendStdin(987654, 'x'), NotFoundError)
    await assert.rejects(sbx.commands.closeStdin(987654), NotFoundError)
  })

  test('pty: create, sendInput, resize, kill', async () => {
    const chunks = []
    const text = () => Buffer.concat(chunks).toString()
    const until = async (want) => {
      for (let i = 0; i < 240 && !text().includes(want); i++) {
        await new Promise((resolve) => setTimeout(resolve, 250))
      }
      assert.ok(text().includes(want), `no ${want} in ${JSON.stringify(text())}`)
    }
    const p = await sbx.pty.create({ cols: 80, rows: 24,
      onData: (d) => { chunks.push(Buffer.from(d)) } })
    await sbx.pty.sendInput(p.pid, new TextEncoder().encode('stty size\n'))
    await until('24 80')
    await sbx.pty.resize(p.pid, { cols: 120, rows: 50 })
    await sbx.pty.sendInput(p.pid, new TextEncoder().encode('stty size\n'))
    await until('50 120')
    assert.equal(await sbx.pty.kill(p.pid), true)
    await assert.rejects(p.wait(), CommandExitError)
    assert.ok(!(await sbx.commands.list()).some((x) => x.pid === p.pid))
  })

  test('files.watchDir sees a written file', async () => {
    await sbx.files.makeDir('/home/user/jswatched')
    const events = []
    const w = await sbx.files.watchDir('/home/user/jswatched', (e) => { events.push(e) })
    await sbx.files.write('/home/user/jswatched/new.txt', 'content')
    for (let i = 0; i < 60 && !events.some((e) => e.name === 'new.txt'); i++) {
      await new Promise((resolve) => setTimeout(resolve, 500))
    }
    await w.stop()
    assert.ok(events.some((e) => e.name === 'new.txt' && e.type === FilesystemEventType.CREATE),
      JSON.stringify(events))
  })

  test('files: write, read, list, makeDir, exists, rename, remove', async () => {
    const info = await sbx.files.write('notes/a.txt', 'hello file')
    assert.equal(info.path, '/home/user/notes/a.txt')
    assert.equal(await sbx.files.read('/home/user/notes/a.txt'), 'hello file')
    const bytes = await sbx.files.read('notes/a.txt', { format: 'bytes' })
    assert.equal(Buffer.from(bytes).toString(), 'hello file')
    assert.equal(await sbx.files.makeDir('/home/user/notes/sub'), true)
    assert.equal(await sbx.files.makeDir('/home/user/notes/sub'), false)
    const names = (await sbx.files.list('/home/user/notes')).map((e) => `${e.name}:${e.type}`)
    assert.deepEqual(names.sort(), ['a.txt:file', 'sub:dir'])
    const many = await sbx.files.write([
      { path: '/home/user/notes/sub/b.txt', data: 'b' },
      { path: '/home/user/notes/sub/c.bin', data: new Uint8Array([0, 1, 2]).buffer },
    ])
    assert.deepEqual(many.map((w) => w.name).sort(), ['b.txt', 'c.bin'])
    const deep = await sbx.files.list('/home/user/notes', { depth: 2 })
    assert.ok(deep.some((e) => e.path === '/home/user/notes/sub/b.txt'))
    assert.equal(await sbx.files.exists('/home/user/notes/a.txt'), true)
    await sbx.files.rename('/home/user/notes/a.txt', '/home/user/notes/moved.txt')
    assert.equal(await sbx.files.exists('/home/user/notes/a.txt'), false)
    await sbx.files.remove('/home/user/notes')
    assert.equal(await sbx.files.exists('/home/user/notes'), false)
    await assert.rejects(sbx.files.read('/home/user/notes/moved.txt'), NotFoundError)
  })

  test('list with a metadata filter, getInfo, setTimeout', async () => {
    const mine = await Sandbox.list({ query: { metadata: { suite: 'e2b-js' } } }).nextItems()
    assert.deepEqual(mine.map((s) => s.sandboxId), [sbx.sandboxId])
    assert.deepEqual(mine[0].metadata, { suite: 'e2b-js' })
    const none = await Sandbox.list({ query: { metadata: { suite: 'nothing' } } }).nextItems()
    assert.deepEqual(none, [])
    const before = await sbx.getInfo()
    assert.equal(before.state, 'running')
    await sbx.setTimeout(1_200_000)
    const later = await sbx.getInfo()
    assert.ok(later.endAt.getTime() - before.endAt.getTime() > 500_000,
      `${before.endAt} -> ${later.endAt}`)
    assert.equal(await sbx.isRunning(), true)
  })

  test('getMetrics: samples from the guest, instance and static', async () => {
    const [m] = await sbx.getMetrics()
    assert.ok(m.timestamp instanceof Date && m.cpuCount >= 1, JSON.stringify(m))
    assert.ok(m.memUsed > 0 && m.memUsed <= m.memTotal && m.diskUsed <= m.diskTotal)
    assert.ok((await Sandbox.getMetrics(sbx.sandboxId)).length >= 1)
  })

  test('downloadUrl / uploadUrl work from plain fetch; a tampered one is a 401', async () => {
    const form = new FormData()
    form.append('file', new Blob(['by signed url']), 'signed.txt')
    const up = await fetch(await sbx.uploadUrl('signed.txt', { useSignatureExpiration: 60 }),
      { method: 'POST', body: form })
    assert.equal(up.status, 200, await up.clone().text())
    const down = await fetch(await sbx.downloadUrl('signed.txt'))
    assert.equal(await down.text(), 'by signed url')
    const bad = await fetch((await sbx.downloadUrl('signed.txt')).replace('signed.txt', 'x'))
    assert.equal(bad.status, 401)
    assert.deepEqual(await bad.json(), { code: 401, message: 'invalid signature' })
  })

  test('connect to a sandbox by id', async () => {
    const again = await Sandbox.connect(sbx.sandboxId)
    assert.equal(again.sandboxId, sbx.sandboxId)
    assert.equal((await again.commands.run('echo $GREETING')).stdout, 'hi\n')
  })

  test('fork: a live copy-on-write child, the source keeps running', async () => {
    await sbx.files.write('/home/user/before-fork', 'shared')
    const children = await sbx.fork({ count: 2, timeoutMs: 120_000 })
    assert.equal(children.length, 2)
    try {
      for (const child of children) {
        assert.ok(child instanceof Sandbox, `${child}`)
        assert.notEqual(child.sandboxId, sbx.sandboxId)
        assert.equal(await child.files.read('/home/user/before-fork'), 'shared')
      }
      await children[0].files.write('/home/user/before-fork', 'changed')
      assert.equal(await children[1].files.read('/home/user/before-fork'), 'shared')
      assert.equal(await sbx.files.read('/home/user/before-fork'), 'shared')
      assert.equal(await sbx.isRunning(), true)
    } finally {
      for (const child of children) if (child instanceof Sandbox) await child.kill()
    }
  })

  test("another account's key does not see the sandbox: 404", async () => {
    await assert.rejects(Sandbox.connect(sbx.sandboxId, other), NotFoundError)
    await assert.rejects(Sandbox.getInfo(sbx.sandboxId, other), NotFoundError)
    assert.equal(await Sandbox.kill(sbx.sandboxId, other), false)
    const theirs = await Sandbox.list({ ...other, query: { metadata: { suite: 'e2b-js' } } })
      .nextItems()
    assert.deepEqual(theirs, [])
    assert.equal(await sbx.isRunning(), true)
  })
})

describe('pause, connect, snapshots', () => {
  test('pause, then connect wakes it with its files', async () => {
    const s = await Sandbox.create({ timeoutMs: 120_000 })
    try {
      await s.files.write('/home/user/kept', 'across a pause')
      await s.pause()
      assert.equal((await Sandbox.getInfo(s.sandboxId)).state, 'paused')
      const paused = await Sandbox.list({ query: { state: ['paused'] } }).nextItems()
      assert.ok(paused.some((x) => x.sandboxId === s.sandboxId))
      const woken = await Sandbox.connect(s.sandboxId, { timeoutMs: 120_000 })
      assert.equal(await woken.files.read('/home/user/kept'), 'across a pause')
      assert.equal((await Sandbox.getInfo(s.sandboxId)).state, 'running')
    } finally {
      await Sandbox.kill(s.sandboxId)
    }
  })

  test('createSnapshot, listSnapshots, create from it, deleteSnapshot', async () => {
    const s = await Sandbox.create({ timeoutMs: 120_000 })
    try {
      await s.files.write('/home/user/baked', 'in the snapshot')
      const snap = await s.createSnapshot()
      assert.ok(snap.snapshotId.startsWith(`snapshot-${s.sandboxId}@`), snap.snapshotId)
      const listed = await s.listSnapshots().nextItems()
      assert.ok(listed.some((x) => x.snapshotId === snap.snapshotId))
      const child = await Sandbox.create(snap.snapshotId, { timeoutMs: 120_000 })
      try {
        assert.equal(await child.files.read('/home/user/baked'), 'in the snapshot')
        const order = (await Sandbox.list({ order: 'asc' }).nextItems()).map((x) => x.sandboxId)
        assert.ok(order.indexOf(s.sandboxId) < order.indexOf(child.sandboxId), `${order}`)
        const fromSnap = await Sandbox.list({ query: { template: snap.snapshotId } })
          .nextItems()
        assert.deepEqual(fromSnap.map((x) => x.sandboxId), [child.sandboxId])
      } finally {
        await child.kill()
      }
      assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
      assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
    } finally {
      await s.kill()
    }
  })
})

describe('bad input', () => {
  // The JS SDK maps a create's 404 to its SandboxError with statusCode 404 (only
  // connect/getInfo/files raise NotFoundError), as it does against E2B.
  test('an unknown template is a 404: SandboxError with statusCode 404', async () => {
    await assert.rejects(Sandbox.create('no-such-template', { timeoutMs: 60_000 }), (err) => {
      assert.ok(err instanceof SandboxError, `${err?.name}: ${err?.message}`)
      assert.equal(err.statusCode, 404)
      assert.match(err.message, /no-such-template/)
      return true
    })
  })

  test('an unknown sandbox id is NotFound; killing it answers false', async () => {
    await assert.rejects(Sandbox.connect('0'.repeat(20)), NotFoundError)
    await assert.rejects(Sandbox.getInfo('0'.repeat(20)), NotFoundError)
    assert.equal(await Sandbox.kill('0'.repeat(20)), false)
  })

  test('a wrong key is an AuthenticationError', async () => {
    await assert.rejects(Sandbox.create({ apiKey: 'e2b_00', timeoutMs: 60_000 }),
      AuthenticationError)
  })

  test('over the machine quota: a 429, the SDK RateLimitError naming the limit', async () => {
    await assert.rejects(
      Sandbox.create({ apiKey: process.env.E2B_FULL_API_KEY, timeoutMs: 60_000 }),
      (err) => {
        assert.ok(err instanceof RateLimitError, `${err?.name}: ${err?.message}`)
        assert.match(err.message, /limit/)
        return true
      })
  })
})

describe('a killed sandbox', () => {
  test('kill; then its commands fail as not running, and it is gone from the list',
    async () => {
      const s = await Sandbox.create({ timeoutMs: 120_000 })
      const h = await s.commands.run('sleep 60', { background: true })
      assert.equal(await s.kill(), true)
      // A gone sandbox answers 502 "... was not found", as E2B's proxy does. The JS SDK
      // makes that a TimeoutError ("likely due to sandbox timeout") on a running
      // command's stream and on file calls, and SandboxNotFoundError on a new command.
      const dead = (err) => {
        assert.ok(err instanceof TimeoutError, `${err?.name}: ${err?.message}`)
        assert.match(err.message, /was not found/)
        return true
      }
      await assert.rejects(h.wait(), dead)
      await assert.rejects(s.files.read('/etc/hostname'), dead)
      await assert.rejects(s.commands.run('true'), SandboxNotFoundError)
      const ids = (await Sandbox.list().nextItems()).map((x) => x.sandboxId)
      assert.ok(!ids.includes(s.sandboxId))
      assert.equal(await Sandbox.kill(s.sandboxId), false)
    })
})
